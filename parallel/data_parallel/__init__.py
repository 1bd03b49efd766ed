"""The data-parallel axis: ZeRO stages 0-3 over flat, constant-size buckets (see ``wrapper``)."""

from parallel.data_parallel.layout import FlatLayout
from parallel.data_parallel.params import ReleasedParameter, UnmaterializedParameterError
from parallel.data_parallel.storage import storage_bytes
from parallel.data_parallel.wrapper import STAGES, DataParallel, DataParallelSettings, DeferredUpdate, ParamInfo

__all__ = ["STAGES", "DataParallel", "DataParallelSettings", "DeferredUpdate", "FlatLayout", "ParamInfo",
           "ReleasedParameter", "UnmaterializedParameterError", "storage_bytes"]
