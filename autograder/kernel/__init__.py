"""What runs inside the learner's sandboxed kernel: start-up (``boot``) and the channel's far
end (``agent``). Rule: imports only ``kernel/`` and ``protocol/``; nothing imports it (it is
started by name, ``protocol.contract``).
"""
