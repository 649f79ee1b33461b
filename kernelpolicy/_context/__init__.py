"""Where a policy lives while code runs: the variable the forwards read, and what sets and carries it.

- ``_active``: the policy in effect, resolved per layer (the table the forwards read);
- ``_traced``: scopes entered where TorchDynamo traces;
- ``_scope``: ``kernel_policy``, ``kernels_disabled``, ``set_default_policy``;
- ``_decorate``: what ``kernel_policy`` does to a function it decorates (coroutines, generators);
- ``_propagate``: the policy carried to threads, pools and processes;
- ``_state``: eager, or which tracer is running.

Imports: ``_values``, ``_compat`` and ``_attributes``.
"""
