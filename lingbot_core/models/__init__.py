"""The LingBot-Video DiT (dense and MoE)."""
