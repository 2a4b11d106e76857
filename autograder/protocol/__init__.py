"""The wire between the trusted runner and the learner's kernel: the data format (``wire``)
and the names both ends agree on (``contract``). Rule: imports nothing from autograder.
"""
