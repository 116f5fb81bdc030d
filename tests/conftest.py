"""Suite-wide settings of the device mode (``tests/device.py``): the report header says which mode ran, and on CUDA
float32 stays float32 (no TF32), so the float32 oracle is exact to float32."""

import torch

from tests.device import DEVICE, describe


def pytest_report_header(config):
    return describe()


if DEVICE.type == "cuda":
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
