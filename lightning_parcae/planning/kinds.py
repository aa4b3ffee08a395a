"""The kinds of migration between two shapes -- the names the planner, the cost model and the runtime share.

Problem: the migration planner labels each plan with its kind and the cost model prices a move by kind; the cost
model also prices a repartition by the planner's own plan of it, so the label cannot live in either module
without an import cycle. It lives here, alone.
"""

from __future__ import annotations

import enum

__all__ = ["MigrationKind"]


class MigrationKind(str, enum.Enum):
    """How the job moves from one shape to another (cheapest first)."""

    NONE = "none"
    INTRA_STAGE = "intra-stage"
    INTER_STAGE = "inter-stage"
    REPARTITION = "repartition"
    RESTART = "restart"
