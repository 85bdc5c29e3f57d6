"""The processes of `pdserve up` that run no model stay light: the launcher (its config validation included), the
router (its servicer) and the gateway (its app) never import torch, which alone costs each ~200 MB of RSS. Each
check runs in a fresh interpreter, so nothing another test imported can hide or cause a failure."""

from __future__ import annotations

import subprocess
import sys

import pytest

# what each process imports on its way to serving (the router imports its servicer in serve(), not at import)
LIGHT = {
    "launcher": "import pdserve.cli.main, pdserve.models.demo, pdserve.models.hub, pdserve.prefill.config\n"
    "from pdserve.cli import launch, up\n"
    "args = up.up_parser().parse_args(['--model', 'm'])\n"
    "engine = up._engine_config(args)  # validates the engine settings, the KV link's included\n"
    "launch.plan_placement(1, 1, launch.parse_gpus(args.gpus, launch.visible_gpus), engine.gpu_memory_utilization)",
    "router": "import pdserve.router.server, pdserve.router.servicer, pdserve.router.registry",
    "gateway": "import pdserve.router.gateway.server, pdserve.router.gateway.app",
}


@pytest.mark.parametrize("process", sorted(LIGHT))
def test_process_does_not_import_torch(process):
    code = LIGHT[process] + "\nimport sys\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", f"the {process} imports torch"


def test_the_check_sees_torch():
    """The probe itself works: a module that does import torch is reported."""
    code = "import pdserve.kv.transfer.handshake\nimport sys\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "True", out.stderr
