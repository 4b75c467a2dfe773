"""The policy and critic models (megatron-core): config, parallel setup, HF conversion,
tokenizers, generation with a KV cache, and dist_checkpointing checkpoints.

No module here imports megatron when imported: the functions that need it import it when
called, so `import hpc` works without megatron-core. See docs/policy.md.
"""

import logging
import warnings

# Lines a user can do nothing about, at the top of every training run: torch says on a machine
# without CUDA that it found no CUDA runtime when megatron imports its extension builder (the CPU
# tier has none, by design); megatron-core says on import, once per module, that Transformer
# Engine and Apex are absent and it falls back to torch (what this package builds on), that a
# default it sets itself is deprecated, and its checkpoint loader calls torch APIs torch deprecates.
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex) (is|are) not installed", category=UserWarning)
warnings.filterwarnings("ignore", message=r"full scope is deprecated", category=UserWarning)
warnings.filterwarnings("ignore", message=r"(`load_state_dict` is deprecated|Please use DTensor instead)",
                        category=FutureWarning)
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
# megatron's checkpoint writer logs each failed write before raising it (hpc.policy.checkpoint says
# it in one line, or lets the exception through): the log line would only say it twice.
logging.getLogger("megatron.core.dist_checkpointing.strategies.filesystem_async").setLevel(logging.CRITICAL)
