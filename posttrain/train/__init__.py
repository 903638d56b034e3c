"""Training loops: offline ones (SFT now; reward model and DPO later) and the one online RL loop."""
