"""The scheduler process: continuous batching, admission, chunked prefill, decode, retraction;
the Role plug that the PD roles (workers/) fill."""
