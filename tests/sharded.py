"""Building the data-parallel wrapper and its sharded AdamW around a small test model in one call."""

from megazero.optim import AdamWSettings, ShardedAdamW
from parallel.data_parallel import DataParallel, DataParallelSettings, ParamInfo

ADAMW_FIELDS = ("lr", "betas", "eps", "weight_decay", "clip_grad", "fused")


def sharded_adamw(model, group, units=(), loss_scaler=None, **settings) -> ShardedAdamW:
    """``settings`` mixes ``AdamWSettings`` and ``DataParallelSettings`` fields; every parameter is
    replicated over tensor ranks (there are none) and counted once in the gradient norm."""
    info = {id(p): ParamInfo(name, None, counts_for_norm=True) for name, p in model.named_parameters()}
    adamw = AdamWSettings(**{k: v for k, v in settings.items() if k in ADAMW_FIELDS})
    dp = DataParallelSettings(**{k: v for k, v in settings.items() if k not in ADAMW_FIELDS})
    wrapper = DataParallel([model], dp, group, units=list(units), info=lambda p: info[id(p)])
    return ShardedAdamW(wrapper, adamw, None, loss_scaler)
