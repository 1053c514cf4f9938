"""Chrome / Perfetto trace (JSON "X" events): one process, one track per rank."""
from __future__ import annotations

from ..kinds import UNSEEN

COLORS = {"data": "grey", "compute": "thread_state_running", "comm": "rail_response",
          "optimizer": "good", "idle": "terrible"}


def chrome_trace(spans: list[dict], world: int) -> dict:
    events = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "paralab"}}]
    for r in range(world):
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": r, "args": {"sort_index": r}})
    for s in spans:
        asynchronous = bool(s.get("args", {}).get("async"))
        # async communication overlaps compute; give it its own track under the rank
        tid = s["rank"] + (1000 if asynchronous else 0)
        events.append({
            "ph": "X", "pid": 0, "tid": tid, "cat": s["category"],
            "name": s["name"] + (f" mb{s['args']['mb']}" if "mb" in s.get("args", {}) else "")
            + (" (until its wait: completion not reported)" if s.get("args", {}).get(UNSEEN) else ""),
            "ts": round(s["t0"] * 1e6, 3), "dur": round((s["t1"] - s["t0"]) * 1e6, 3),
            "args": {"step": s["step"], "bytes": s["bytes"], **s.get("args", {})},
            "cname": COLORS.get(s["category"], "generic_work"),
        })
    for r in sorted({s["rank"] for s in spans if s.get("args", {}).get("async")}):
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": r + 1000,
                       "args": {"name": f"rank {r} async comm"}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}
