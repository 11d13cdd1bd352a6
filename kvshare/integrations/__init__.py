"""kvshare's pool plugged into other inference engines (optional; each needs its engine).

Nothing in the core package imports these modules, and these modules import their engine
only where they plug into it: `kvshare.integrations.vllm` needs `pip install kvshare[vllm]`.
"""
