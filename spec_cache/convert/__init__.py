"""Convert: formats from elsewhere into ours and back: GGUF weights, mlx-lm prompt-cache files and its
server's cache interface, the seed's ``.mlxkv`` layout. Stands on ``decode`` and the rooms below it.
"""
