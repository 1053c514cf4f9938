"""The pieces of training every rank and the single-process reference share: the loss, the
learning-rate schedule, the test-split evaluation."""
