"""numpy reference executor for saved ML Programs (prediction without macOS)."""

from coreml.mil.errors import MilError, UnsupportedOp
from coreml.mil.executor import Executor, State
from coreml.mil.loader import Program, blob_const_digests, load_program

__all__ = ["Executor", "MilError", "Program", "State", "UnsupportedOp", "blob_const_digests", "load_program"]
