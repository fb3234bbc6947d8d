"""The one table every registered unit lives in (pipeline.ground.registry): precisions, targets,
package kinds and recipes each refuse a second unit of a name, and name the asker and the known
units when a lookup misses."""

import pytest

from coreml.kinds import KINDS, UnknownKind, package_kind
from coreml.precisions import PRECISIONS, UnknownPrecision, precision
from coreml.recipes import RECIPES
from coreml.recipes.base import UnknownRecipe
from coreml.targets import TARGETS, UnknownTarget, target
from pipeline.ground.errors import CmfdeployError
from pipeline.ground.registry import RegisteredTwice, Registry


class Missing(CmfdeployError):
    pass


def test_a_registry_keeps_order_refuses_a_second_unit_and_names_the_known_ones():
    table = Registry("colour", Missing)
    assert table.add("red", 1) == 1 and table.add("blue", 2) == 2
    assert list(table) == ["red", "blue"] and table.lookup("blue", "--colour") == 2
    with pytest.raises(RegisteredTwice, match="colour 'red' is registered twice"):
        table.add("red", 3)
    assert table["red"] == 1
    with pytest.raises(Missing, match=r"^--colour: colour 'green' is not among \['red', 'blue'\]$"):
        table.lookup("green", "--colour")


@pytest.mark.parametrize("table, lookup, unknown", [
    (PRECISIONS, precision, UnknownPrecision),
    (TARGETS, target, UnknownTarget),
    (KINDS, package_kind, UnknownKind),
    (RECIPES, RECIPES.lookup, UnknownRecipe),
])
def test_every_unit_table_is_a_registry(table, lookup, unknown):
    assert isinstance(table, Registry) and table.unknown is unknown
    first = next(iter(table))
    assert lookup(first, "here") is table[first]
    with pytest.raises(unknown, match=f"^here: {table.what} 'nonesuch' is not among"):
        lookup("nonesuch", "here")
    with pytest.raises(RegisteredTwice):
        table.add(first, table[first])
