"""What the parts of the elastic runtime have in common: each acts for the one runtime that owns it.

Problem: one process's live-reconfiguration protocol has several halves -- the generation switch, failure
recovery, admission of a joiner, the leader's shape choice -- kept in modules of their own, each acting for the
:class:`~lightning_parcae.runtime.elastic.ElasticRuntime` that owns it and reading the protocol's state there. That
module imports the parts, so the parts must not import it back. :class:`RuntimePart` states that relation once.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RuntimePart"]


class RuntimePart:
    """One part of a process's live-reconfiguration protocol.

    Args:
        rt: The :class:`~lightning_parcae.runtime.elastic.ElasticRuntime` it acts for (not imported here: the
            runtime owns this part without an import cycle).
    """

    def __init__(self, rt: Any) -> None:
        self.rt = rt
