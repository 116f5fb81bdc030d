"""FLUX 3 Image Klein's transformer files: BFL's naming, the architecture read from a file's shapes (the two
variants told apart by the flow map's ``ref_time_in``), and the linears a quantized storage may hold."""

from __future__ import annotations

from ...errors import Flux2Error
from ...key_tables import Layout, same_names
from ..family import ShapeReader
from .transformer import Flux3Params

# every block and modulation; the input embedders, time embedders and the final layer stay float (small, and every
# token's scale comes from them)
QUANTIZABLE = ("content_mode_blocks.", "txt_mode_blocks.", "single_blocks.", "early_stream_modulations.",
               "single_stream_modulations.")


def quantizable(name: str) -> bool:
    return name.startswith(QUANTIZABLE)


def read_params(file: ShapeReader) -> Flux3Params:
    """The architecture from the shapes; RoPE axes and theta are the reference's (a file does not record them)."""
    hidden, in_channels = file.shape("emb_in.image.weight")
    head_dim = file.shape("single_blocks.0.norm.query_norm.scale")[0]
    mlp_hidden = file.shape("single_blocks.0.mlp_out.weight")[1]
    try:
        return Flux3Params(in_channels=in_channels, context_in_dim=file.shape("txt_in.weight")[1], hidden_size=hidden,
                           num_heads=hidden // head_dim, depth=file.count("txt_mode_blocks.{}.q_proj.weight"),
                           depth_single_blocks=file.count("single_blocks.{}.q_proj.weight"),
                           mlp_ratio=mlp_hidden / hidden, axes_dim=(head_dim // 4,) * 4,
                           flow_map=file.has("ref_time_in.in_layer.weight"))
    except ValueError as e:
        raise Flux2Error(f"{file.where}: the architecture read from the file is inconsistent ({e})") from None


LAYOUTS = (Layout("BFL", "early_stream_modulations.txt.lin.weight", same_names),)
