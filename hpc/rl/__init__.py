"""Reinforcement learning for the policy: advantages (GAE for PPO with a critic, group-normalized
for GRPO) and the losses of one update, on token tensors of shape [batch, tokens] with a mask of
the tokens the policy generated (observations of tools in a multi-turn trajectory are masked out)."""
