"""What LoRA matching and its messages know of FLUX 3 Image Klein: its report groups and its model by width."""

from __future__ import annotations

from ..family import AdapterNaming

ADAPTERS = AdapterNaming(groups=(("early blocks", "content_mode_blocks."), ("text blocks", "txt_mode_blocks."),
                                 ("single blocks", "single_blocks.")),
                         models={3072: "FLUX 3 Image Klein"}, lookalikes=(), other_depths=(),
                         shape_hint=lambda module, found, hidden: "")
