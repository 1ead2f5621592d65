#!/usr/bin/env python3
"""Where a traced step's GPU time goes: sums the kernels of a Chrome trace written by
`moerl bench train --trace FILE` by kind (GEMM, attention, elementwise, ...) and by name, and
compares the GPU's busy time with the step's wall time (idle time = launch or host bound), and says where the GPU waited: the longest idle gaps and the
host operators that were running through them.

    python3 bench/trace_kernels.py TRACE.json [--top 25]
"""
import argparse
import bisect
import json
import re
import sys

# First match wins; a kernel's name is matched in lower case.
KINDS = [
    ("attention", r"flash|fmha|attention|sdpa"),
    ("gemm", r"gemm|cutlass|xmma|nvjet|cublas|sm90_|sm80_|wgmma|matmul"),
    ("optimizer", r"adam|multi_tensor|fused_adamw"),
    ("index/scatter/gather", r"index|scatter|gather|embedding|take"),
    ("sort/topk", r"sort|topk|radix|cub::"),
    ("reduce", r"reduce|norm|softmax|sum|mean|max"),
    ("copy/cast", r"copy|memcpy|cast|convert|fill|memset|cat"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise"),
]


def kind_of(name):
    n = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, n):
            return kind
    return "other"


def busy_us(spans):
    """Length of the union of [start, end) spans."""
    total, end = 0.0, None
    for s, e in sorted(spans):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def idle_gaps(spans, min_us):
    """[(start, end)] of the stretches between GPU activity longer than min_us."""
    out, end = [], None
    for s, e in sorted(spans):
        if end is not None and s - end > min_us:
            out.append((end, s))
        end = e if end is None else max(end, e)
    return out


def gap_report(gpu, host, spans, top):
    """Idle time by the host operator that was running when the GPU ran dry (the innermost one
    spanning the gap's start), and the longest gaps with their neighbours."""
    gaps = idle_gaps(spans, 5.0)
    if not gaps:
        return
    ops = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e["name"]) for e in host)
    starts = [o[0] for o in ops]
    by_kernel_end = sorted((float(e["ts"]) + float(e.get("dur", 0)), e["name"]) for e in gpu)
    ends = [k[0] for k in by_kernel_end]
    by_kernel_start = sorted((float(e["ts"]), e["name"]) for e in gpu)

    def host_op_at(t):
        # The shortest operator that contains t: the innermost call.
        best = None
        i = bisect.bisect_right(starts, t)
        for j in range(max(0, i - 400), i):
            s, e, name = ops[j]
            if s <= t <= e and (best is None or e - s < best[1] - best[0]):
                best = (s, e, name)
        return best[2] if best else "(no operator: host code between operators)"

    by_op = {}
    for s, e in gaps:
        op = host_op_at(s + 1.0)
        by_op.setdefault(op, [0.0, 0])
        by_op[op][0] += e - s
        by_op[op][1] += 1
    total = sum(e - s for s, e in gaps)
    print()
    print(f"idle gaps over 5 us: {len(gaps)}, {total / 1e3:.1f} ms; by the host operator running as the GPU ran dry")
    print(f"{'host operator':<72} {'ms':>8} {'gaps':>6}")
    for op, (d, n) in sorted(by_op.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{op[:72]:<72} {d / 1e3:8.2f} {n:6d}")
    print()
    print(f"{'longest gaps: us':>16}  after kernel -> before kernel")
    for s, e in sorted(gaps, key=lambda g: g[0] - g[1])[: min(top, 15)]:
        i = bisect.bisect_right(ends, s + 0.5) - 1
        j = bisect.bisect_left(by_kernel_start, (e - 0.5, ""))
        before = by_kernel_end[i][1][:45] if i >= 0 else "-"
        after = by_kernel_start[j][1][:45] if j < len(by_kernel_start) else "-"
        print(f"{e - s:16.0f}  {before} -> {after}  [{host_op_at(s + 1.0)[:40]}]")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    try:
        with open(args.trace) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"trace_kernels: cannot read {args.trace}: {e}")
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        sys.exit(f"trace_kernels: {args.trace} holds no GPU kernels (a CPU run, or no CUPTI)")
    host = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")]
    spans = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in gpu]
    first, last = min(s for s, _ in spans), max(e for _, e in spans)
    if host:
        first = min(first, min(float(e["ts"]) for e in host))
    wall = last - first
    busy = busy_us(spans)
    by_kind, by_name = {}, {}
    for e in gpu:
        d = float(e.get("dur", 0))
        k = kind_of(e["name"]) if e["cat"] == "kernel" else "copy/cast"
        by_kind.setdefault(k, [0.0, 0])
        by_kind[k][0] += d
        by_kind[k][1] += 1
        by_name.setdefault(e["name"], [0.0, 0, k])
        by_name[e["name"]][0] += d
        by_name[e["name"]][1] += 1
    # The operator that launched each kernel: the innermost one, by the trace's "External id".
    # Operators inside an autograd node's evaluation are the backward's: marked "(bwd)".
    backward = {}
    for e in host:
        if e["name"].startswith("autograd::engine::evaluate_function"):
            backward.setdefault(e.get("tid"), []).append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))))
    for spans_of_thread in backward.values():
        spans_of_thread.sort()

    def in_backward(e):
        spans_of_thread = backward.get(e.get("tid"), [])
        i = bisect.bisect_right(spans_of_thread, (float(e["ts"]), float("inf"))) - 1
        return i >= 0 and spans_of_thread[i][1] >= float(e["ts"]) + float(e.get("dur", 0))

    op_of, dims_of = {}, {}
    for e in host:
        a = e.get("args") or {}
        ext = a.get("External id")
        if ext is not None and not e["name"].startswith("autograd::"):
            op_of[ext] = e["name"] + (" (bwd)" if in_backward(e) else "")
            dims_of[ext] = str([d for d in a.get("Input Dims", []) if d])
    by_op, by_shape = {}, {}
    for e in gpu:
        ext = (e.get("args") or {}).get("External id")
        op = op_of.get(ext, "(no operator)")
        d = float(e.get("dur", 0))
        by_op.setdefault(op, [0.0, 0])
        by_op[op][0] += d
        by_op[op][1] += 1
        key = (op, dims_of.get(ext, ""))
        by_shape.setdefault(key, [0.0, 0])
        by_shape[key][0] += d
        by_shape[key][1] += 1
    total = sum(v[0] for v in by_kind.values())
    print(f"traced update: {wall / 1e3:.1f} ms wall, GPU busy {busy / 1e3:.1f} ms "
          f"({100 * busy / wall:.0f}%), {len(gpu)} kernels and copies")
    print()
    print(f"{'kind':<22} {'ms':>9} {'share':>7} {'count':>7}")
    for k, (d, n) in sorted(by_kind.items(), key=lambda kv: -kv[1][0]):
        print(f"{k:<22} {d / 1e3:9.1f} {100 * d / total:6.1f}% {n:7d}")
    print()
    print(f"{'top operators (GPU time of their kernels)':<52} {'ms':>9} {'share':>7} {'kernels':>8}")
    for op, (d, n) in sorted(by_op.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"{op[:52]:<52} {d / 1e3:9.1f} {100 * d / total:6.1f}% {n:8d}")
    print()
    print(f"{'top operators by input shapes':<88} {'ms':>8} {'kernels':>8}")
    for (op, dims), (d, n) in sorted(by_shape.items(), key=lambda kv: -kv[1][0])[: args.top]:
        label = f"{op} {dims}"
        print(f"{label[:88]:<88} {d / 1e3:8.1f} {n:8d}")
    print()
    print(f"{'top kernels':<72} {'ms':>8} {'share':>7} {'count':>6}")
    for name, (d, n, k) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[: args.top]:
        short = re.sub(r"^void ", "", name).replace("at::native::", "").replace("(anonymous namespace)::", "")
        short = short if len(short) <= 70 else short[:67] + "..."
        print(f"{short:<72} {d / 1e3:8.1f} {100 * d / total:6.1f}% {n:6d}")
    gap_report(gpu, host, spans, args.top)


if __name__ == "__main__":
    main()
