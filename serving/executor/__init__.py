"""Running a batch: ForwardBatch building and the model call (model_runner), CUDA graphs,
sampling and constrained decoding."""
