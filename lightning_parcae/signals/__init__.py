"""Availability signals: what the job knows about its instances, past and imminent.

Problem: planning needs two kinds of input. The *history* of instance counts (:mod:`~lightning_parcae.signals.traces`:
spot traces in several formats, replayed or recorded) feeds the forecast; *notices* (:mod:`~lightning_parcae.signals.
notices`: AWS, GCP, Azure, POSIX signals or a replayed trace behind one interface) say that an instance is about to
leave, so the job can act before it disappears. This is the bottom of the flow: nothing here imports torch or any
other part of the package but :mod:`lightning_parcae.errors`.
"""

from lightning_parcae.signals.notices import (
    Notice,
    NoticeSource,
    NoticeWatcher,
    make_notice_source,
)

__all__ = ["Notice", "NoticeSource", "NoticeWatcher", "make_notice_source"]
