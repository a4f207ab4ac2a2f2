"""Loading: hub ids and folders (`checkpoint`), GGUF targets (`gguf`), weights, the embedded
default (`assets`, `defaults`), oMLX settings (`omlx`), and the platform: BLAS and precision
(`blas`, `runtime`).
"""
