"""The SGLang model classes of the families Trident trains, as an SGLang external model package.

SGLang resolves a server's architecture through its ``ModelRegistry``, which by default imports every
module of ``sglang.srt.models`` first (~250 of them: 1.5 s of CPU in each TP worker, measured with
sglang 0.5.23). With ``SGLANG_EXTERNAL_MODEL_PACKAGE`` naming this package it imports only these
(``sglang/srt/models/registry.py``); an architecture not here (a judge model of another family, say)
still resolves, through SGLang's full import. ``engine.rollout.sglang_server`` sets the variable
unless the user has set their own.
"""
