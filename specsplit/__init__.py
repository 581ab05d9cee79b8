"""specsplit: speculative decoding split across a draft and a target gRPC service."""

__version__ = "0.1.0"
