"""Values a manifest copies from an upstream report or manifest, compared with the upstream.

A gate manifest repeats its report's verdict and summary; a survey repeats each gate's
numbers; a release repeats the gates, tolerances, sizes and interface of what it ships.
A copy that differs from its upstream is a claim nothing backs: IdentityError naming the
copying file and field and both values.
"""

from pathlib import Path

from pipeline.ground.errors import IdentityError

_MISSING = object()


def check_copied(where: str | Path, field: str, copied: dict, upstream: dict, upstream_where: str | Path,
                 keys=None) -> None:
    """`copied[key] == upstream[key]` for every key in `keys` (default: every key of `copied`).

    `where`/`field` name the copy (`field` may be "" for the top level), `upstream_where`
    the file it was copied from.
    """
    for key in copied if keys is None else keys:
        mine, theirs = copied.get(key, _MISSING), upstream.get(key, _MISSING)
        if mine != theirs:
            shown = lambda v: "absent" if v is _MISSING else repr(v)  # noqa: E731
            name = f"{field}.{key}" if field else key
            raise IdentityError(f"{where}: field {name!r} is {shown(mine)}, but {upstream_where} says {shown(theirs)}")
