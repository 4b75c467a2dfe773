"""The agent's instructions (INSTRUCTIONS.md and the system prompt) and the task prompt.

Our own SKILL-style text: the files, how model_new.py calls kernels, the rules the evaluator
enforces (no PyTorch computation in forward, no torch headers, the library rules), the tools and
their call format, the workflow and the reward table. It is rendered from the configs in force,
so what it says about the backend, the reward and the limits is what the episode applies.
"""

from __future__ import annotations

import json
from string import Template

from hpc.agent.config import AgentConfig
from hpc.agent.toolcall import CLOSE, OPEN
from hpc.agent.tools import SINGLE_TURN_TOOLS, TOOLS
from hpc.compile.native import arch_flags
from hpc.config import EvalConfig
from hpc.task import Task

_HEADER = Template("""\
# Optimize a PyTorch model with your own $language kernels

`model.py` holds a PyTorch model, `Model`. Write `ModelNew` in `model_new.py`: the same
computation, done by kernels you write in `kernels/`, and faster. Backend: **$backend**.

## Files

- `model.py`: the reference (read-only): `Model`, `get_inputs()`, `get_init_inputs()`. It is
  evaluated at the **$scale** scale: the file's module globals (the sizes), with the overrides of
  its `SCALES["$scale"]` dict if it has one.
- `INSTRUCTIONS.md`: this text (read-only).
- `model_new.py`: yours. `class ModelNew(nn.Module)` with the same constructor arguments as
  `Model` and the same parameter names: the reference's weights are loaded into it by name. A
  starter with `Model`'s constructor is there; its `forward` is yours to write.
- `kernels/`: yours. $sources, compiled together into one library
  (`$compiler`). Headers (`.h`, `.hpp`, `.cuh`) may sit next to them.

Only `model_new.py` and `kernels/` are evaluated; other files you create are ignored.

## Calling your kernels

Every `extern "C"` function in `kernels/` becomes a callable of `kernels`:

```python
import torch
import torch.nn as nn
from hpc.runtime import load_kernels

kernels = load_kernels(__file__)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        x = x.contiguous()
        out = torch.empty_like(x)
        kernels.relu(out, x, x.numel())
        return out
```

```$fence
$kernel_example
```

Arguments convert by type: a tensor passes its data pointer (it must be contiguous and on
$device), an `int` or `bool` passes `int64_t`, a `float` passes `double`.$stream Functions
return `void`.

## Rules (the evaluator enforces them; breaking one scores -1)

1. `forward` may only allocate tensors (`torch.empty`, `empty_like`, `zeros`, ...), take views
   (`view`, `reshape`, `permute`, `transpose`, ...), make tensors contiguous, and call your
   kernels. Any other PyTorch computation in `forward` (torch or `F.` functions, calling `nn`
   modules, a fallback to PyTorch in a `try`/`except` or a branch) is a violation, and at least
   one of your kernels must run. Preparing parameters in `__init__` is free.$allowed_ops
2. `model_new.py` imports only `torch`, `torch.nn`, `torch.nn.functional`, `math`, `typing`,
   `functools`, `dataclasses` and `hpc.runtime`; no `exec`, `eval`, `open`, threads or
   introspection.
3. Kernel sources include no torch, ATen, c10, pybind11 or Python headers, load nothing at run
   time (`dlopen`/`dlsym`) and use $libraries.
4. Outputs must match the reference exactly in shape and dtype and within tolerance in value
   (float32: $tolerance) on fresh random inputs, including scaled ones: handle every input, at full
   precision. Do not modify the inputs.
5. `model.py` and `INSTRUCTIONS.md` cannot be changed (edits are refused or reverted); the
   evaluator uses its own copy of the task anyway.

""")

_TOOLS = Template("""\
## Tools

Call a tool by writing a block that holds one JSON object, its name and its arguments:

$example

Several blocks in one reply run in order (at most $max_calls). Strings are JSON strings: a newline
inside file content is `\\n`, a quote is `\\"`. Each result comes back in the next message as
`<tool_result name="..." status="ok|error">...</tool_result>`; output longer than $obs_chars
characters is cut in the middle. Text inside `<think>...</think>` is never run.

$tool_list

Paths are relative to the workdir (no absolute paths, no `..`). `bash` runs with no network,
writes only inside the workdir, ${reads}and is killed after
$bash_timeout s; nothing it starts outlives it. `python -c "import model_new"` builds your kernels
and loads your model as the evaluator does.
compile, verify and profile evaluate the current `model_new.py` and `kernels/` exactly as the
reward does; asking again about an unchanged state returns the same result.

## Workflow

1. Read `model.py`: what is computed, on which shapes (at the $scale scale).
2. Write a kernel in `kernels/` and call it from `model_new.py`.
3. `compile` until it builds, `verify` until it is correct, then `profile`.
4. Optimize (fusion, memory access, parallelism, vectorization), `profile` after each change,
   and keep what is faster. Keep the workdir correct: $state_rule
5. Call `finish` when you are done$no_call_rule.

You have $max_turns replies; the conversation may hold about $context tokens.

""")

_SINGLE = Template("""\
## Your reply

Write the whole solution in this one reply: `model_new.py` and every kernel file, each with a
`write_file` call:

$example

Tools here: $tools. Strings are JSON strings: a newline inside file content is `\\n`, a quote
is `\\"`. There is no feedback: the files your reply writes are evaluated as they are.

""")

_REWARD = Template("""\
## Reward

$table
$timing
""")

_TIMING = """
Times are medians over many calls, each on fresh inputs after a cache flush, timed to the end of
all device work; outputs of timed calls are checked too, so caching results across calls or
deferring work does not pay.
"""

_CPU_TIMING = """\
Every evaluation runs your kernels in processes of their own. A scratch buffer from `malloc`,
`new` or `std::vector` starts 0, 16, 32 or 48 bytes into a cache line, as each process's
allocations fall, and a vector loop over it can run twice as long at one offset as at another:
allocate scratch with `std::aligned_alloc(64, bytes)` (bytes a multiple of 64) so that your time
repeats.
"""

_CPU_KERNEL = """\
#include <cstdint>

extern "C" void relu(float* out, const float* x, int64_t n) {
    #pragma omp parallel for
    for (int64_t i = 0; i < n; ++i) out[i] = x[i] > 0.0f ? x[i] : 0.0f;
}"""

_CUDA_KERNEL = """\
#include <cstdint>
#include <cuda_runtime.h>

__global__ void relu_kernel(float* out, const float* x, int64_t n) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i] > 0.0f ? x[i] : 0.0f;
}

extern "C" void relu(float* out, const float* x, int64_t n, cudaStream_t stream) {
    relu_kernel<<<(n + 255) / 256, 256, 0, stream>>>(out, x, n);
}"""


def call_example(name: str, arguments: dict) -> str:
    """A tool call exactly as the parser reads it."""
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CLOSE}"


def render_instructions(eval_cfg: EvalConfig, cfg: AgentConfig) -> str:
    """INSTRUCTIONS.md (also the system prompt) for the configs in force."""
    cuda = eval_cfg.backend == "cuda"
    libs = eval_cfg.rules.libraries
    ops = eval_cfg.rules.allowed_torch_ops
    text = _HEADER.substitute(
        language="CUDA" if cuda else "C++", backend=eval_cfg.backend, scale=eval_cfg.scale,
        sources="`kernels/*.cu`: CUDA C++" if cuda else "`kernels/*.cpp`: C++17, OpenMP allowed",
        compiler=(f"nvcc -O3 {' '.join(arch_flags(eval_cfg.compile.cuda_arch))} -std=c++17 --use_fast_math" if cuda
                  else "g++ -O3 -march=native -std=c++17 -fopenmp"),
        fence="cuda" if cuda else "cpp", kernel_example=_CUDA_KERNEL if cuda else _CPU_KERNEL,
        device="the GPU" if cuda else "the CPU", tolerance=f"{eval_cfg.correctness.atol_fp32:g}",
        stream=(" The current CUDA stream is appended as a last argument: every launcher's signature ends "
                "with `cudaStream_t stream`, and its kernels launch on it." if cuda else ""),
        allowed_ops=(f" These extra PyTorch operators are allowed in `forward`: {', '.join(ops)}." if ops else ""),
        libraries=(f"no library but the C/C++ runtime{', the CUDA runtime' if cuda else ''} and "
                   f"{', '.join(libs)}" if libs else
                   f"no library but the C/C++ runtime{' and the CUDA runtime' if cuda else ''}"))
    write = call_example("write_file", {"path": "kernels/relu." + ("cu" if cuda else "cpp"),
                                        "content": "#include <cstdint>\n..."})
    if cfg.mode == "single_turn":
        text += _SINGLE.substitute(example=write, tools=", ".join(SINGLE_TURN_TOOLS))
    else:
        tool_list = "\n".join(f"- `{spec.usage()}`: {spec.doc}"
                              + ("".join(f" `{p.name}`: {p.doc}." for p in spec.params)) for spec in TOOLS.values())
        example = write + "\n" + call_example("bash", {"command": "ls -l kernels"})
        state_rule = ("your reward is that of the workdir when the episode ends." if cfg.state == "final" else
                      "your reward is that of the fastest correct state you profiled (by speedup over "
                      "torch.compile) or the final state, whichever is faster.")
        text += _TOOLS.substitute(
            example=example, max_calls=cfg.max_calls_per_turn, obs_chars=cfg.observation_chars, tool_list=tool_list,
            bash_timeout=f"{cfg.bash.timeout_s:g}", scale=eval_cfg.scale, state_rule=state_rule,
            reads=("reads only the system, Python, the `hpc` package and the workdir, " if cfg.bash.confine_reads
                   else ""),
            no_call_rule=(" (a reply without a tool call also ends the episode)" if cfg.end_without_tool_call
                          else ""),
            max_turns=cfg.max_turns, context=f"{cfg.max_context_tokens:,}")
    text += _REWARD.substitute(table=_reward_table(eval_cfg), timing=_TIMING + ("" if cuda else "\n" + _CPU_TIMING))
    return text


def _reward_table(eval_cfg: EvalConfig) -> str:
    r = eval_cfg.reward
    margin = f"{100 * r.margin:g}%"
    if r.kind == "continuous":
        return (f"| outcome | reward |\n|---|---|\n| fails a rule, compilation or correctness | {r.incorrect:g} |\n"
                f"| correct | its speedup over torch.compile (time of torch.compile / your time) |")
    return (f"| outcome | reward |\n|---|---|\n"
            f"| fails a rule, compilation or correctness | {r.incorrect:g} |\n"
            f"| correct | 1 |\n"
            f"| correct and more than {margin} faster than eager PyTorch | 2 |\n"
            f"| correct and more than {margin} faster than both eager PyTorch and torch.compile | 3 |")


def task_prompt(task: Task, eval_cfg: EvalConfig, cfg: AgentConfig) -> str:
    """The first user message: the task's source and what to do with it."""
    source = task.path.read_text(encoding="utf-8", errors="replace")
    what = ("Reply with the complete solution now." if cfg.mode == "single_turn" else
            "The workdir holds model.py, INSTRUCTIONS.md, a starter model_new.py and an empty kernels/. Begin.")
    return (f"Task {task.task_id} (backend {eval_cfg.backend}, scale {eval_cfg.scale}). model.py:\n\n"
            f"```python\n{source.rstrip()}\n```\n\n{what}")
