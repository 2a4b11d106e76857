"""The class's grading, one stage per file: ``course`` (the folders and the release),
``collect``, ``exchange``, ``worker`` (one submission), ``grade`` (the batch), ``report``,
``check`` (the learner's Validate), ``bench``.
"""
