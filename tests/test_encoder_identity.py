"""Which text encoder a file is, across families: Qwen3-4B (FLUX.2 Klein 4B's) and Qwen3-VL-4B's text tower (FLUX 3
Image Klein's) have the same shapes, so only what the file says (its config, its tower's names, its name) tells them
apart; the family asking decides the rest, and every message is worded from the asking family's own spec."""

import json
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from flux2_core import weights
from flux2_core.errors import Flux2Error
from flux2_core.families.flux2.variants import QWEN3_4B
from flux2_core.families.flux3.variants import QWEN3_VL_4B
from tests.tiny.flux3 import TINY_QWEN3_VL_TEXT
from tests.tiny.text_encoder import TINY_QWEN3_CONFIG, build_tiny_qwen3, comfyui_state_dict

# what each tower is called by a file that says so by its name (ComfyUI's names) and by one that says nothing
NAMES = {"qwen3": "qwen_3_4b.safetensors", "qwen3-vl": "qwen3vl_4b.safetensors"}
UNTOLD = "text_encoder.safetensors"
# how the file may say which model it is: its name, the Qwen3-VL checkpoint's tower names, a Hugging Face folder's
# config.json; or nothing at all
MARKS = ("none", "name", "tower", "config")


@dataclass(frozen=True)
class EncoderFile:
    model: str      # what the tensors really are: "qwen3" or "qwen3-vl"
    mark: str       # how the file says it (MARKS)
    layers: int

    @property
    def says(self) -> str | None:
        """What the file says it is, by this test's own reading of the mark."""
        return None if self.mark == "none" else self.model


def encoder_files():
    def valid(f: EncoderFile) -> bool:        # only Qwen3-VL checkpoints have a text tower behind language_model.
        return not (f.mark == "tower" and f.model == "qwen3")
    return st.builds(EncoderFile, st.sampled_from(["qwen3", "qwen3-vl"]), st.sampled_from(MARKS),
                     st.sampled_from([28, 32])).filter(valid)


def write(f: EncoderFile, folder) -> str:
    """The tiny tower saved as the mark says; returns what a user passes (a file or a folder)."""
    base = TINY_QWEN3_VL_TEXT if f.model == "qwen3-vl" else TINY_QWEN3_CONFIG
    config = {**base, "num_hidden_layers": f.layers}
    state = comfyui_state_dict(build_tiny_qwen3(0, config))
    if f.mark == "tower":
        state = {"model.language_model." + k.removeprefix("model."): v for k, v in state.items()}
    folder.mkdir(parents=True)
    if f.mark == "config":
        save_file(state, str(folder / "model.safetensors"))
        text = {**config, "model_type": "qwen3"}
        if f.model == "qwen3-vl":
            text = {"model_type": "qwen3_vl", "text_config": {**config, "model_type": "qwen3_vl_text"}}
        (folder / "config.json").write_text(json.dumps(text))
        return str(folder)
    path = folder / (NAMES[f.model] if f.mark == "name" else UNTOLD)
    save_file(state, str(path))
    return str(path)


ASKING = {"nobody": None, "FLUX.2 Klein 4B": QWEN3_4B, "FLUX 3 Image Klein": QWEN3_VL_4B}
# what each model's messages must name (its reader, its deepest layer read) and must not (the other family)
READER = {"qwen3": "FLUX.2 Klein", "qwen3-vl": "FLUX 3 Image Klein"}
DEEPEST = {"qwen3": 27, "qwen3-vl": 32}
OTHER_FAMILY = {"qwen3": "FLUX 3", "qwen3-vl": "FLUX.2"}


@settings(max_examples=14, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(f=encoder_files(), asking=st.sampled_from(sorted(ASKING)))
def test_which_encoder_a_file_is_decides_or_refuses_in_the_asking_familys_words(tmp_path_factory, f, asking):
    """Draws a tiny tower (Qwen3 or Qwen3-VL, 28 or 32 layers), how its file says what it is (nothing, its name, the
    VL tower's names, a config.json) and who asks (nobody, FLUX.2 Klein 4B, FLUX 3 Image Klein). Expected: a file
    that says it is the other model is refused naming the asker's file; one that says nothing is read as Qwen3 unless
    FLUX 3 asks, which refuses "cannot tell" naming its file; too few layers are refused with the asker's layers and
    file; every refusal is worded from the asker's spec, never from the other family's."""
    spec = ASKING[asking]
    path = write(f, tmp_path_factory.mktemp("te") / "encoder")
    read_as = spec.model if spec is not None else (f.says or "qwen3")
    refused = spec is not None and f.says != spec.model and (f.says is not None or spec.model == "qwen3-vl")
    if not refused and f.layers >= DEEPEST[read_as]:
        encoder = weights.load_text_encoder(path, "cpu", torch.float32, spec=spec)
        assert encoder.spec.model == read_as
        return
    with pytest.raises(Flux2Error) as error:
        weights.load_text_encoder(path, "cpu", torch.float32, spec=spec)
    message = str(error.value)
    assert NAMES[read_as] in message and READER[read_as] in message, message
    if refused and f.says is None:
        assert "cannot tell" in message, message
    if not refused:                                      # too shallow: the layers its reader reads, in its words
        assert f"{f.layers} layers" in message and str(DEEPEST[read_as]) in message, message
        assert OTHER_FAMILY[read_as] not in message, message
