"""tokenpace: fair, predictable output-token pacing for shared vLLM deployments."""

__version__ = "0.1.0"
