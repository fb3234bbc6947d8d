"""Worker processes that share the cores: the survey's recipes, the conversion's package kinds."""

import os


def thread_share_env(jobs: int) -> dict[str, str]:
    """This process's environment with each BLAS/OpenMP pool at 1/`jobs` of the cores, for one
    of `jobs` worker processes running side by side (each would otherwise claim them all)."""
    threads = str(max(1, (os.cpu_count() or 1) // jobs))
    return {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "OPENBLAS_NUM_THREADS": threads}
