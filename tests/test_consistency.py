"""Ranks that disagree on the config or the code refuse to train together, naming the odd ranks.

``verify_consistent`` runs before any work on every rank of a real 3-rank gloo world: equal runs
pass; a rank launched with another override, or running another checkout (its code fingerprint
differs), makes every rank raise the same one-line error naming that rank and what differs.
Planted bug this caught: the code-version comparison left out (only the config compared).
"""

import pytest

import megazero.startup as startup
from megazero.config import load_config
from megazero.errors import UserError
from tests.distributed import run_world

BASE = ["--model.num_layers", "2", "--train.device", "cpu"]


def _outcome(cfg) -> str:
    try:
        startup.verify_consistent(cfg)
        return "ok"
    except UserError as exc:
        assert exc.agreed, "every rank raises this line: rank 0 alone should print it"
        return str(exc)


def _world(rank, world_size):
    out = {"same": _outcome(load_config(None, BASE))}
    lr = ["--optimizer.lr", "1e-3"] if rank == 2 else []
    out["config"] = _outcome(load_config(None, BASE + lr))
    real = startup.code_fingerprint
    if rank == 1:
        startup.code_fingerprint = lambda: "another-checkout"
    try:
        out["code"] = _outcome(load_config(None, BASE))
    finally:
        startup.code_fingerprint = real
    return out


@pytest.fixture(scope="module")
def outcomes():
    return run_world(3, _world)


def test_equal_ranks_pass(outcomes):
    assert [o["same"] for o in outcomes] == ["ok"] * 3


@pytest.mark.parametrize("case, odd, what", [("config", [2], "config"), ("code", [1], "code version")])
def test_every_rank_names_the_odd_one(outcomes, case, odd, what):
    messages = {o[case] for o in outcomes}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert message.startswith(f"ranks {odd} run a different {what} from rank 0"), message
    assert "\n" not in message


def test_the_fingerprint_covers_every_package_a_run_imports():
    """Ranks of two checkouts that differ only in the model or the data pipeline train apart all the
    same: every package of this checkout that a training run imports must be in the fingerprint. The
    imports are those of a fresh interpreter (this one holds whatever earlier tests imported)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(startup.__file__).resolve().parent.parent
    listing = """import sys
from pathlib import Path
import megazero.cli, megazero.trainer  # what ``megazero train`` imports
root, installed = Path(sys.argv[1]), Path(sys.prefix).resolve()  # a virtual environment may sit in the checkout
for name, module in list(sys.modules.items()):
    file = getattr(module, "__file__", None)  # torch.ops names a bare "_ops.py"
    if file and Path(file).is_absolute() and Path(file).resolve().is_relative_to(root) \\
            and not Path(file).resolve().is_relative_to(installed):
        print(name.split(".")[0])
"""
    out = subprocess.run([sys.executable, "-c", listing, str(root)], capture_output=True, text=True, check=True,
                         cwd=root).stdout
    imported = set(out.split())
    assert {"megazero", "models", "parallel", "data_pipeline"} <= imported
    assert imported <= set(startup.PACKAGES)
