"""Suite-wide settings of the device mode (``tests/device.py``): the report header says which mode ran, and on CUDA
float32 stays float32 (no TF32), so the float32 oracle is exact to float32. The machine every test assumes
(``tests/machine.py``): its CPU probes pinned for the session, each test started on the default. Fixtures that several
files use."""

import pytest
import torch

from flux2_core import kitchen
from flux2_core.storage import linear
from tests import machine as machines
from tests.device import DEVICE, describe

PINNED: machines.Pinned | None = None


def pytest_configure(config):
    global PINNED
    PINNED = machines.Pinned(machines.default())


def pytest_addoption(parser):
    parser.addoption("--only-listed", metavar="FILE", help="run only the tests whose ids FILE lists, one a line "
                     "(scripts/test's second passes: the tests that read the machine, again as each other kind)")


def listed_ids(config) -> set[str] | None:
    listed = config.getoption("--only-listed")
    if not listed:
        return None
    if not hasattr(config, "_flux2_listed"):
        with open(listed) as f:
            config._flux2_listed = {line.strip() for line in f if line.strip()}
    return config._flux2_listed


def pytest_ignore_collect(collection_path, config):
    """With --only-listed, test files that hold none of the listed tests are not even imported (each pass is faster)."""
    wanted = listed_ids(config)
    if wanted is None or collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    try:
        relative = collection_path.relative_to(config.rootpath).as_posix()
    except ValueError:                       # outside the root: pytest decides as without the option
        return None
    return None if any(test.split("::")[0] == relative for test in wanted) else True


def pytest_collection_modifyitems(config, items):
    wanted = listed_ids(config)
    if wanted is None:
        return
    config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in wanted])
    items[:] = [item for item in items if item.nodeid in wanted]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    PINNED.begin(item.nodeid, real=item.get_closest_marker("real_machine") is not None)


@pytest.fixture
def machine() -> machines.Pinned:
    """The pinned machine: ``machine.set(machines.ZEN4)`` for a test of a rule on that CPU."""
    return PINNED


@pytest.fixture
def fresh_kitchen():
    """comfy-kitchen's cached decisions forgotten before and after (so their log lines come again)."""
    kitchen.forget()
    yield
    kitchen.forget()


@pytest.fixture
def plain_ops(monkeypatch, fresh_kitchen):
    """The plain torch path everywhere: what a compiled block runs, so eager and compiled compute the same operations
    (eager would otherwise take comfy-kitchen's fused kernels on CUDA, and oneDNN's matmul on the CPU)."""
    monkeypatch.setenv("FLUX2_NO_KITCHEN", "1")
    monkeypatch.setattr(linear, "ONEDNN_LINEAR", False)


@pytest.fixture
def no_kitchen(monkeypatch, fresh_kitchen):
    """comfy-kitchen as if it were not installed."""
    monkeypatch.setattr(kitchen, "_imported", lambda: (None, "No module named 'comfy_kitchen'"))


def pytest_report_header(config):
    return [describe(), f"machine: {PINNED.default}"]


if DEVICE.type == "cuda":
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@pytest.fixture
def fakes():
    """start(**knobs) -> a running fake ComfyUI (tests/batch_fakes.py); each is stopped after the test (a hung one
    cannot be, and its thread is a daemon)."""
    from tests.batch_fakes import FakeServer

    servers = []

    def start(**kw):
        servers.append(FakeServer(**kw))
        return servers[-1]
    yield start
    for server in servers:
        if not server.hung:
            server.stop()
