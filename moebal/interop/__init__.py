"""Reading and writing other projects' formats (Hugging Face checkpoints, safetensors)."""
