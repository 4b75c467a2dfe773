"""The multi-turn agent environment: an episode workdir, tools, limits and the reward.

    from hpc.agent import Episode, LocalBackend, agent_config
    episode = Episode(task, LocalBackend(eval_cfg), agent_config(preset="train"), root)
    trajectory = episode.run(policy)        # policy.respond(messages) -> str (ReplayPolicy, OpenAIChatPolicy)
    trajectory.reward, trajectory.to_dict()

See docs/agent.md.
"""

from hpc.agent.backend import EvalBackend, LocalBackend, PoolBackend, PoolClient
from hpc.agent.config import AgentConfig, agent_config, load_agent_config
from hpc.agent.episode import Episode, Policy, Trajectory, approx_tokens
from hpc.agent.openai_client import OpenAIChatPolicy
from hpc.agent.policy import ReplayPolicy

__all__ = ["AgentConfig", "Episode", "EvalBackend", "LocalBackend", "OpenAIChatPolicy", "Policy", "PoolBackend",
           "PoolClient", "ReplayPolicy", "Trajectory", "agent_config", "approx_tokens", "load_agent_config"]
