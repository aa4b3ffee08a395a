"""The run's event log: one whole JSON line per event, from any number of processes writing at once."""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path

from lightning_parcae.events import EVENTS_FILE, append_event


def test_an_event_is_one_json_line_with_a_time(tmp_path: Path) -> None:
    append_event(tmp_path, {"event": "start", "step": 3})
    append_event(tmp_path, {"event": "end", "time": 12.5})
    lines = (tmp_path / EVENTS_FILE).read_text().splitlines()
    first, second = (json.loads(x) for x in lines)
    assert first["event"] == "start" and first["step"] == 3 and isinstance(first["time"], float)
    assert second["time"] == 12.5  # a time the writer gives is kept


def _writer(run_dir: str, k: int) -> None:
    for i in range(200):
        append_event(run_dir, {"event": "progress", "writer": k, "i": i, "pad": "x" * 500})


def test_concurrent_writers_never_interleave_a_line(tmp_path: Path) -> None:
    """Four processes append 200 lines of ~600 bytes each: every line parses and none is lost."""
    procs = [mp.get_context("spawn").Process(target=_writer, args=(str(tmp_path), k)) for k in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    events = [json.loads(x) for x in (tmp_path / EVENTS_FILE).read_text().splitlines()]
    assert sorted((e["writer"], e["i"]) for e in events) == [(k, i) for k in range(4) for i in range(200)]
