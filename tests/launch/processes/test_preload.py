"""--preload auto: what the zygote imports, read from the entrypoint's source, and when workers
are not forked (a program that is not Python; an environment read at start that differs)."""

from __future__ import annotations

from pathlib import Path

import pytest
from elastic_launch.processes.entrypoint import Entrypoint, Kind
from elastic_launch.processes.preload import import_time_mismatch, plan


def preloads_torch(ep: Entrypoint) -> bool:
    """Whether --preload auto has the zygote import torch for `ep` (it imports torch)."""
    return "torch" in plan(["auto"], ep).modules


def script(path: Path, text: str) -> Entrypoint:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return Entrypoint(Kind.SCRIPT, str(path))


@pytest.mark.parametrize(
    "text",
    [
        "import torch\n",
        "import torch.distributed as dist\n",
        "from torch import nn\n",
        "def main():\n    import torch\n",
        "if __name__ == '__main__':\n    from torch import nn\n",
        "import os, torch\n",
    ],
)
def test_a_script_that_imports_torch_gets_it_preloaded(tmp_path, text):
    ep = script(tmp_path / "train.py", text)
    assert preloads_torch(ep)
    assert plan(["auto"], ep).modules == ["torch"]


@pytest.mark.parametrize(
    "text",
    [
        "import os\nprint('torch')\n",
        "import torchvision_like\n",  # a name that starts with torch is not torch
        "# import torch\n",
        "this is not python (\n",
        "import importlib\nimportlib.import_module('torch')\n",  # not seen: no import statement
    ],
)
def test_a_script_without_torch_gets_a_zygote_without_it(tmp_path, text):
    ep = script(tmp_path / "train.py", text)
    assert not preloads_torch(ep)
    chosen = plan(["auto"], ep)
    assert chosen.zygote and chosen.modules == [] and chosen.why_not is None


def test_torch_imported_by_the_scripts_own_modules_is_found(tmp_path):
    script(tmp_path / "lib" / "__init__.py", "")
    script(tmp_path / "lib" / "model.py", "from . import layers\n")
    script(tmp_path / "lib" / "layers.py", "import torch.nn\n")
    script(tmp_path / "helpers.py", "from lib.model import Net\n")
    ep = script(tmp_path / "train.py", "import helpers\n")
    assert preloads_torch(ep)
    # a cycle ends
    script(tmp_path / "a.py", "import b\n")
    script(tmp_path / "b.py", "import a\n")
    assert not preloads_torch(script(tmp_path / "c.py", "import a\n"))


def test_a_module_entrypoint_and_a_directory_are_read(tmp_path, monkeypatch):
    script(tmp_path / "pkg" / "__init__.py", "")
    script(tmp_path / "pkg" / "train.py", "from pkg import model\n")
    script(tmp_path / "pkg" / "model.py", "from torch import nn\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert preloads_torch(Entrypoint(Kind.MODULE, "pkg.train"))
    assert preloads_torch(Entrypoint(Kind.MODULE, "torch.distributed.run"))
    assert not preloads_torch(Entrypoint(Kind.MODULE, "json.tool"))
    script(tmp_path / "app" / "__main__.py", "import torch\n")
    assert preloads_torch(Entrypoint(Kind.SCRIPT, str(tmp_path / "app")))


def test_a_function_entrypoint_is_read_from_its_module(tmp_path, monkeypatch):
    script(tmp_path / "fn_with_torch.py", "def train():\n    import torch\n")  # not run here
    script(tmp_path / "fn_without.py", "def train():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import fn_with_torch
    import fn_without

    assert preloads_torch(Entrypoint(Kind.FUNCTION, fn_with_torch.train))
    assert not preloads_torch(Entrypoint(Kind.FUNCTION, fn_without.train))
    assert not preloads_torch(Entrypoint(Kind.FUNCTION, len))  # a builtin: nothing to read


def test_a_script_on_the_classic_train_loop_gets_the_loop_preloaded(tmp_path):
    ep = script(tmp_path / "loop.py", "import torch\nfrom elastic_launch.train_loop import train\n")
    assert plan(["auto"], ep).modules == [
        "torch",
        "elastic_launch.train_loop",
        "elastic_launch.rendezvous.etcd.v3",
    ]
    ep = script(tmp_path / "other.py", "import elastic_launch\nimport elastic_core\n")
    assert plan(["auto"], ep).modules == [], "the launcher's own packages load as needed"


@pytest.mark.parametrize(
    "text",
    [
        "import torch\nopt = torch.optim.SGD(params, lr=0.1)\n",
        "import torch.optim as optim\n",
        "from torch.optim import AdamW\n",
        "from torch import optim\n",
        "import torch\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n",
        "import torch\nmodel = torch.nn.parallel.DistributedDataParallel(net)\n",
    ],
)
def test_a_script_that_builds_an_optimizer_or_ddp_gets_dynamo_preloaded(tmp_path, text):
    """Their first construction imports torch._dynamo: seconds in every new worker, paid once
    in the zygote instead (named too, it is preloaded once)."""
    ep = script(tmp_path / "train.py", text)
    assert plan(["auto"], ep).modules == ["torch", "torch._dynamo"]
    assert plan(["auto", "torch._dynamo"], ep).modules == ["torch", "torch._dynamo"]


def test_a_script_that_uses_the_sampler_or_checkpoints_gets_them_preloaded(tmp_path):
    """elastic_sampler takes 45 ms to import with torch loaded, on each new worker's way to
    its first step: preloaded after torch, as any installed package the script imports."""
    ep = script(
        tmp_path / "train.py", "import torch\nfrom elastic_sampler import save_checkpoint\n"
    )
    assert plan(["auto"], ep).modules == [
        "torch",
        "elastic_sampler",
        "elastic_sampler:save_checkpoint",
    ]
    bare = script(tmp_path / "bare.py", "import elastic_sampler\n")
    assert plan(["auto"], bare).modules == ["elastic_sampler"]


def test_the_installed_packages_a_script_imports_as_it_starts_are_preloaded(tmp_path, monkeypatch):
    """Lightning, Accelerate, transformers... whatever the script imports at its top and is
    installed: a new worker skips those imports. Not what a function imports (it may never
    run), not the standard library, not the script's own modules (their import is the
    script's code, which may read a worker's RANK), not what is not installed."""
    site = tmp_path / "site"
    for name in ("heavy_framework", "other_lib", "late_lib"):
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text("")
    (site / "heavy_framework" / "trainer.py").write_text("")
    monkeypatch.syspath_prepend(str(site))
    job = tmp_path / "job"
    job.mkdir()
    (job / "mymodel.py").write_text("import os\nRANK = os.environ['RANK']\n")
    ep = script(
        job / "train.py",
        "import os, json\n"
        "import torch\n"
        "from heavy_framework.trainer import Trainer\n"
        "import mymodel\n"
        "import not_installed_anywhere\n"
        "try:\n    import other_lib\nexcept ImportError:\n    other_lib = None\n"
        "def main():\n    import late_lib\n"
        "if __name__ == '__main__':\n    main()\n",
    )
    chosen = plan(["auto"], ep)
    # MODULE:NAME: what `from MODULE import NAME` loads (a lazy package loads it only then).
    expected = ["heavy_framework.trainer", "heavy_framework.trainer:Trainer", "other_lib"]
    assert chosen.modules == ["torch", *expected]
    assert chosen.optional == tuple(expected), "left out if they make forking unsafe"


@pytest.mark.parametrize(
    "text",
    [
        "import torch\nx = torch.ones(3)\n",
        "import numpy as np\nopt = np.optim\n",  # no torch: nothing of torch's
    ],
)
def test_a_script_without_an_optimizer_or_ddp_gets_no_dynamo(tmp_path, text):
    ep = script(tmp_path / "train.py", text)
    assert "torch._dynamo" not in plan(["auto"], ep).modules


def test_named_modules_come_on_top_and_none_means_fresh(tmp_path):
    ep = script(tmp_path / "train.py", "import torch\n")
    assert plan(["auto", "numpy"], ep).modules == ["torch", "numpy"]
    assert plan(["auto", "torch"], ep).modules == ["torch"]
    assert plan(["json"], ep).modules == ["json"]  # the API without auto: exactly these
    off = plan([], ep)
    assert not off.zygote and off.why_not is None


def test_a_program_that_is_not_python_says_why(tmp_path):
    binary = Entrypoint(Kind.BINARY, "/bin/echo", ["hi"])
    chosen = plan(["auto"], binary)
    assert not chosen.zygote
    assert chosen.why_not is not None
    assert "--preload auto: '/bin/echo' is not run by Python" in chosen.why_not
    assert "--preload numpy:" in (plan(["auto", "numpy"], binary).why_not or "")


def test_an_environment_read_at_start_that_differs_is_named():
    zygote = {"PATH": "/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": "/a"}
    same = {**zygote, "RANK": "3", "MASTER_PORT": "1234", "PYTHON_EXEC": "python3"}
    assert import_time_mismatch(zygote, same) is None
    why = import_time_mismatch(zygote, {**same, "OMP_NUM_THREADS": "4"})
    assert why is not None and "OMP_NUM_THREADS='4'" in why
    why = import_time_mismatch(zygote, {k: v for k, v in same.items() if k != "PYTHONPATH"})
    assert why is not None and "PYTHONPATH unset" in why
    assert import_time_mismatch(zygote, {**same, "LD_PRELOAD": "x.so"}) is not None
    assert import_time_mismatch(zygote, {**same, "TORCH_LOGS": "+dynamo"}) is not None
    assert import_time_mismatch(zygote, {**same, "NCCL_DEBUG": "INFO"}) is None  # read later
