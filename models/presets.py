"""Named model architectures applied before a config's own values.

``gpt2`` is the MT-NLG 530B family (learned positions, LayerNorm, GeLU, tied head, biases);
``llama`` is the rotary / RMSNorm / SwiGLU / untied family without biases. A preset only fills the
architecture switches; sizes come from the config (see configs/ for the named sizes).
"""

MODEL_PRESETS = {
    "gpt2": {
        "position_embedding": "learned",
        "norm": "layernorm",
        "activation": "gelu",
        "tie_embeddings": True,
        "bias": True,
    },
    "llama": {
        "position_embedding": "rope",
        "norm": "rmsnorm",
        "activation": "swiglu",
        "tie_embeddings": False,
        "bias": False,
    },
}
