"""The node check: every collective's results and bus bandwidth per message size, as nccl-tests reports
them, and each ordered pair's send/recv bandwidth, with the slow rank or link named.

--option keys (nccl-tests' flag in brackets): min_bytes [-b], max_bytes [-e], step_factor [-f],
iters [-n], warmup [-w], check [-c], average [-a], ops (comma-separated), pair_bytes, pair_rounds,
pairs (0: no pairwise matrix), slow_ratio, slow_link_fails (1: a slow link fails the
node on gloo too). Fault injection, to see the slow-link finding:
inject_slow_send_rank=R makes rank R sleep inject_slow_send_ms (default 20) before each pairwise send.
"""

from distcheck import scenario

# Defaults: on NCCL, nccl-tests' -w 5 -n 20, swept to 1 GiB where the links plateau; on gloo a short
# sweep, because the check runs in the default catalogue.
NCCL = {"min_bytes": 64, "max_bytes": 1 << 30, "step_factor": 4, "warmup": 5, "iters": 20, "pair_bytes": 64 << 20}
GLOO = {"min_bytes": 4 << 10, "max_bytes": 1 << 20, "step_factor": 16, "warmup": 1, "iters": 5, "pair_bytes": 1 << 20}


def _on_gpu_links(ctx) -> bool:
    """NCCL on GPUs: real links. gloo moves even CUDA tensors through host sockets."""
    return ctx.backend == "nccl" and ctx.device.type == "cuda"


def _settings(ctx) -> dict:
    from distcheck.knowledge import nccl_tests

    o = {**(NCCL if _on_gpu_links(ctx) else GLOO), **ctx.options}
    ops = [op.strip() for op in str(o.get("ops", ",".join(nccl_tests.OPS))).split(",") if op.strip()]
    for op in ops:
        nccl_tests.bus_factor(op, 2)   # an unknown op: one clear error before anything runs
    return {
        "sizes": nccl_tests.sweep(nccl_tests.parse_size(o["min_bytes"]), nccl_tests.parse_size(o["max_bytes"]),
                                 float(o["step_factor"])),   # a whole number, as nccl-tests' -f
        "warmup": int(o["warmup"]), "iters": max(1, int(o["iters"])), "check": bool(int(o.get("check", 1))),
        "average": int(o.get("average", 1)), "ops": ops,
        "pair_count": nccl_tests.parse_size(o["pair_bytes"]) // 4, "pair_rounds": int(o.get("pair_rounds", 3)),
        "pairs": bool(int(o.get("pairs", 1))), "slow_ratio": float(o.get("slow_ratio", 0.7)),
        "slow_rank": int(o["inject_slow_send_rank"]) if "inject_slow_send_rank" in o else None,
        "slow_s": float(o.get("inject_slow_send_ms", 20)) / 1e3,
        "floors": nccl_tests.parse_floors(o["min_busbw"]) if "min_busbw" in o else {},
    }


def _placement(op, c, seconds, wrong, n, check) -> dict:
    from distcheck.knowledge import nccl_tests
    from distcheck.rank.sweep import ELEMENT_SIZE

    return {"time_us": seconds * 1e6, "algbw": nccl_tests.algbw(op, c.param, ELEMENT_SIZE, seconds, n),
            "busbw": nccl_tests.busbw(op, c.param, ELEMENT_SIZE, seconds, n), "wrong": wrong if check else None}


def _sweep(ctx, s) -> list[dict]:
    """One record per op and size: nccl-tests' columns, out-of-place and in-place."""
    from distcheck.knowledge import nccl_tests
    from distcheck.rank import sweep

    n, rank, dev = ctx.world_size, ctx.rank, ctx.device
    records = []
    for op in s["ops"]:
        if op == "sendrecv" and n < 2:
            continue   # torch cannot send to its own rank
        for size in s["sizes"]:
            # nccl-tests' row for every swept size, also where the op's per-rank slice rounds down to 0
            c = nccl_tests.counts(op, size, sweep.ELEMENT_SIZE, n)
            record = {"op": op, "size": nccl_tests.size_column(c, sweep.ELEMENT_SIZE), "count": c.param,
                      "type": sweep.TYPE_NAME, "redop": nccl_tests.redop(op), "root": nccl_tests.root(op),
                      "out_of_place": None, "in_place": None}
            for placement in sweep.PLACEMENTS[op]:
                call = sweep.build(op, placement == "in", c, rank, n, dev)
                t = sweep.measure(call, s["warmup"], s["iters"], dev, s["average"], s["check"])
                record["in_place" if placement == "in" else "out_of_place"] = _placement(
                    op, c, t.seconds, t.wrong, n, s["check"])
                where = "in place" if placement == "in" else "out of place"
                ctx.require(f"{op} {where} correct at {record['size']} B", t.wrong == 0,
                            f"{op} ({where}) of {record['size']} bytes returned {t.wrong} wrong elements",
                            op=op, wrong=t.wrong)
            records.append(record)
    return records


def _g(x: float) -> float:
    return float(f"{x:.4g}")


def _cells(p) -> list:
    if p is None:
        return ["-"] * 4
    return [round(p["time_us"], 1), _g(p["algbw"]), _g(p["busbw"]), "n/a" if p["wrong"] is None else p["wrong"]]


def _floors(ctx, records, floors) -> None:
    """--min-busbw: each op's busbw at its largest size (out of place where torch has it)."""
    from distcheck.knowledge import nccl_tests

    for op in dict.fromkeys(r["op"] for r in records):
        floor = nccl_tests.floor_of(floors, op)
        if floor is None:
            continue
        last = [r for r in records if r["op"] == op][-1]
        busbw = (last["out_of_place"] or last["in_place"])["busbw"]
        ctx.require(f"{op} busbw", busbw >= floor,
                    f"{op} bus bandwidth {busbw:.3g} GB/s at {last['size']} bytes is below the --min-busbw "
                    f"floor of {floor:g} GB/s", op=op, busbw=busbw, floor=floor, size=last["size"])


def _pairs(ctx, s) -> None:
    """The pairwise send/recv matrix, and a requirement on each rank named by a slow link."""
    from distcheck.diagnose.links import slow_links
    from distcheck.rank import sweep

    n = ctx.world_size
    matrix = sweep.pair_matrix(s["pair_count"], s["warmup"], s["iters"], ctx.device, s["pair_rounds"],
                               s["slow_rank"], s["slow_s"])
    size = s["pair_count"] * sweep.ELEMENT_SIZE
    ctx.report_table(
        f"Send/recv per ordered pair (GB/s, {size} B, {n} ranks): row sends, column receives",
        ["from \\ to"] + [str(d) for d in range(n)],
        [[src] + ["-" if src == dst else _g(matrix[src, dst]) for dst in range(n)] for src in range(n)],
        records=[{"src": src, "dst": dst, "bytes": size, "gbps": gbps} for (src, dst), gbps in matrix.items()])
    # On gloo a "link" is a host socket, on one node loopback on shared cores: it measures the scheduler,
    # so a slow one is shown (info) but fails the node only when asked (slow_link_fails=1); on NCCL it is
    # a real link.
    fails = bool(int(ctx.options.get("slow_link_fails", _on_gpu_links(ctx))))
    for link in slow_links(matrix, s["slow_ratio"]):
        if ctx.rank in link.ranks:
            ctx.require(f"slow link {link.kind} {'->'.join(map(str, link.ranks))}", False, link.describe(),
                        severity="error" if fails else "info", link=link.kind, ranks=list(link.ranks), gbps=link.gbps,
                        reference_gbps=link.reference_gbps)


@scenario(expect="pass", min_world_size=1)
def comm_health(ctx):
    """The node check, as nccl-tests measures it: every collective's results (#wrong) and bus bandwidth
    per message size, out of place and in place, and each ordered pair's send/recv bandwidth with the
    slow rank or link named; --min-busbw [OP=]GB/s fails the node below a floor."""
    from distcheck.rank.sweep import AVERAGE

    s = _settings(ctx)
    records = _sweep(ctx, s)
    ctx.report_table(
        f"Bus bandwidth ({ctx.backend}, {ctx.world_size} ranks, {ctx.device.type}; time in us, "
        f"{AVERAGE[s['average']]} over ranks; algbw and busbw in GB/s)",
        ["op", "size", "count", "type", "redop", "root", "oop time", "oop algbw", "oop busbw", "oop #wrong",
         "ip time", "ip algbw", "ip busbw", "ip #wrong"],
        [[r["op"], r["size"], r["count"], r["type"], r["redop"], r["root"], *_cells(r["out_of_place"]),
          *_cells(r["in_place"])] for r in records], records=records)
    _floors(ctx, records, s["floors"])
    if s["pairs"] and ctx.world_size >= 2:
        _pairs(ctx, s)
