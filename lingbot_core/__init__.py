"""LingBot-Video core: models, scheduler, loading and pipeline stages. Never imports ComfyUI."""
