"""Every module of the four packages imports when it is the first of them imported.

A circle through a package's ``__init__`` passes while something else imports the package first,
which every test and command does, and breaks a user's script that starts from the module in the
circle: ``import megazero.training_schedules`` failed with "cannot import name ... from partially
initialized module" (the config package validates with the schedules, which imported the config
schema for their annotations). The import graph's check reads the modules' own import lines and
did not see it.
"""

import subprocess
import sys

PACKAGES = ("megazero", "parallel", "models", "data_pipeline")

# One interpreter for every module: torch stays loaded, the project's modules are forgotten before
# each import. An optional dependency not installed (Triton off GPU machines) is not the project's.
SCRIPT = f"""
import importlib, pkgutil, sys
import torch
PACKAGES = {PACKAGES!r}
names = [m.name for p in PACKAGES for m in pkgutil.walk_packages(importlib.import_module(p).__path__, p + ".")]
for name in names:
    for loaded in [k for k in sys.modules if k.split(".")[0] in PACKAGES]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name.split(".")[0] in PACKAGES:
            print(name, repr(e))
    except Exception as e:
        print(name, repr(e))
"""


def test_every_module_imports_first():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "", done.stdout


# The command line's parser, every subcommand registered, and a data command run to its end.
DATA_COMMAND = """
import sys
from megazero.cli import main
code = main(["tokenizer", "train", "--input", sys.argv[1], "--vocab-size", "300", "--model-prefix", sys.argv[2]])
print(code, sorted(m for m in ("torch", "models", "megazero.config") if m in sys.modules))
"""


def test_the_data_commands_do_not_import_torch(tmp_path):
    """Every ``megazero`` command builds every subcommand's parser; train's imported the config, and
    plan's the whole planner, for its GPU presets: both pull in the model and torch, about 2 s that
    ``megazero preprocess``, ``curate`` and ``tokenizer`` paid on each call for nothing (planted: the
    config imported at train's top again; the planner package loading its modules eagerly)."""
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(f'{{"text": "document {i} of a few words, repeated {i} times"}}\n' for i in range(200)))
    done = subprocess.run([sys.executable, "-c", DATA_COMMAND, str(docs), str(tmp_path / "tok")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "0 []", done.stdout + done.stderr
