"""MLX fallback runtime that executes CMF quantized dtypes on MLX quantized kernels."""
