"""SkyRL before 42f3d44b3 (from 7f5eba15f, 2026-04-08): ``choices[0].routed_experts`` as nested
JSON lists (``resp.routed_experts.tolist()`` in skyrl/backends/skyrl_train/inference_servers/
vllm_server_actor.py), ``[rows, layers, topk]`` from the request's
``routed_experts_prompt_start``. The lists are parsed plainly (no blob to splice) and narrowed
to the smallest dtype holding the ids."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from r3data.wire.anchors import anchored_pos
from r3data.wire.producers.base import ROUTES_FIELD
from r3data.wire.producers.common import any_choice, nested_rows
from r3data.wire.producers.skyrl import SkyrlFormat
from r3data.wire.rows import InlineRows, RowSource

__all__ = ["FORMAT", "SkyrlV1Format"]


class SkyrlV1Format(SkyrlFormat):
    name = "skyrl-v1"
    versions = "main 7f5eba15f-42f3d44b3 (nested JSON lists)"
    fields = (ROUTES_FIELD,)
    spliced = ()
    current = False

    def recognise(self, doc: Any) -> bool:
        return (
            isinstance(doc, Mapping)
            and doc.keys() == {"choices"}
            and any_choice(doc, lambda c: isinstance(c.get(ROUTES_FIELD), list))
        )

    def route_rows(
        self,
        value: object,
        start: int,
        prompt: int | None,
        completion: int | None,
        meta: dict,
        what: str,
    ) -> RowSource:
        rows = nested_rows(value, 3, what)
        anchored_pos(rows.shape[0], prompt, completion, start, what=what)
        return InlineRows(ROUTES_FIELD, rows, start, meta)

    def routes_value(self, routes: np.ndarray) -> Any:
        return routes.tolist()


FORMAT = SkyrlV1Format()
