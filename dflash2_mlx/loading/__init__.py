"""Loading: files into model objects (`dflash2_mlx.pair` makes a `Pipeline` of them): hub ids
and folders (`checkpoint`), Hub downloads and their errors (`hub`), the published drafter of a
target (`drafters`), GGUF targets (`gguf`), weights, the embedded default (`assets`,
`defaults`), oMLX settings (`omlx`), and the platform: BLAS and precision (`blas`, `runtime`).
"""
