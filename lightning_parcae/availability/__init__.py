"""Availability signals: how the job learns that instances are about to leave.

Problem: the planner reacts to the instance count, but acting *before* an instance disappears needs the notice its
cloud (or scheduler) gives. :mod:`~lightning_parcae.availability.notices` reads those notices from AWS, GCP, Azure,
POSIX signals or a replayed trace behind one interface. Nothing here imports torch.
"""

from lightning_parcae.availability.notices import (
    Notice,
    NoticeSource,
    NoticeWatcher,
    make_notice_source,
)

__all__ = ["Notice", "NoticeSource", "NoticeWatcher", "make_notice_source"]
