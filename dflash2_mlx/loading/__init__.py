"""Loading: a target and its drafter into a `Pipeline` (`pair`: `dflash2_mlx.load`), hub ids
and folders (`checkpoint`), Hub downloads and their errors (`hub`), the published drafter of a
target (`drafters`), GGUF targets (`gguf`), weights, the embedded default (`assets`,
`defaults`), oMLX settings (`omlx`), and the platform: BLAS and precision (`blas`, `runtime`).
"""
