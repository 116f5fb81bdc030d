"""What LoRA matching and its messages know of FLUX.2: its report groups, its models by width, and FLUX.1's adapters,
often taken for FLUX.2's."""

from __future__ import annotations

import re

from ..family import AdapterNaming

# LoRAs: a FLUX.1 adapter's names (checked on keys that matched none of ours); FLUX.1's MLP is 4 x hidden, FLUX.2's 3 x
FLUX1_ADAPTER = re.compile(r"(?:img|txt)_mod[._]lin(?:$|[._])|single_blocks[._]\d+[._]modulation[._]lin|norm1(?:_context)?"
                           r"[._]linear|single_transformer_blocks[._]\d+[._](?:proj_mlp|norm[._]linear)|ff(?:_context)?"
                           r"[._]net[._]|distilled_guidance_layer")


def adapter_shape_hint(module: str, found: tuple[int, int], hidden: int) -> str:
    if module.endswith((".linear1", "_mlp.0")) and found[0] in (7 * hidden, 4 * hidden):
        return " Its MLP width is FLUX.1's (4x hidden): this is a FLUX.1 LoRA, which does not fit FLUX.2."
    return ""


ADAPTERS = AdapterNaming(groups=(("double blocks", "double_blocks."), ("single blocks", "single_blocks.")),
                         models={3072: "Klein 4B", 4096: "Klein 9B", 6144: "FLUX.2 dev"},
                         lookalikes=((FLUX1_ADAPTER, "FLUX.1"),),
                         other_depths=(("FLUX.1", {"double blocks": 19, "single blocks": 38}),),
                         shape_hint=adapter_shape_hint)
