"""The CMF v2 container library (spec: CMF-V2.md): read, write, verify, sign, skills."""

from pipeline.ground.cmf.dtypes import DTYPES, DType, dtype_by_name, dtype_for_id
from pipeline.ground.cmf.hash64 import hash64
from pipeline.ground.cmf.masks import Masks, TaskMask
from pipeline.ground.cmf.reader import CmfFile, Envelope, TensorInfo, open_cmf
from pipeline.ground.cmf.verify import VerifyFailure, VerifyReport, sign_cmf, verify_cmf
from pipeline.ground.cmf.writer import RawTensor, write_cmf

__all__ = [
    "DTYPES",
    "CmfFile",
    "DType",
    "Envelope",
    "Masks",
    "RawTensor",
    "TaskMask",
    "TensorInfo",
    "VerifyFailure",
    "VerifyReport",
    "dtype_by_name",
    "dtype_for_id",
    "hash64",
    "open_cmf",
    "sign_cmf",
    "verify_cmf",
    "write_cmf",
]
