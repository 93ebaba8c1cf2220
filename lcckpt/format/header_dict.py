"""The preset dictionary of compressed headers (container format version 4).

A small model's delta file carries a sizeable header: the CNN of the quality benchmark
wrote 1.5-2 KB of compressed JSON beside 14-18 KB of blobs, most of it the same keys,
optimizer settings and section fields in every file. Deflate can start from a
dictionary of such text (RFC 1950 ``FDICT``): the stream then names it by its Adler-32,
and the first occurrence of each fragment costs a back reference instead of its letters.

These bytes are part of the format: a version 4 reader needs exactly them, so they never
change (``tests/test_container.py`` pins their Adler-32). A later dictionary would be a
new format version. Fragments are listed from the rarest to the most common, since deflate
codes a nearer match (one closer to the end of the dictionary) in fewer bits.
"""

import zlib

_FRAGMENTS = (
    # layer names of common models (transformers, convnets)
    'word_embeddings', 'position_embeddings', 'token_type_embeddings', 'embed_tokens',
    'lm_head', 'attention.self.query', 'attention.self.key', 'attention.self.value',
    'attention.output.dense', 'attention.output.LayerNorm', 'intermediate.dense',
    'output.dense', 'output.LayerNorm', 'self_attn.q_proj', 'self_attn.k_proj',
    'self_attn.v_proj', 'self_attn.o_proj', 'mlp.gate_proj', 'mlp.up_proj', 'mlp.down_proj',
    'input_layernorm', 'post_attention_layernorm', 'attn.c_attn', 'attn.c_proj', 'mlp.c_fc',
    'mlp.c_proj', 'ln_1', 'ln_2', 'ln_f', 'wte', 'wpe', 'transformer.h.', 'model.layers.',
    'encoder.layer.', 'embeddings.', 'LayerNorm', 'layer_norm', 'downsample', 'running_mean',
    'running_var', 'num_batches_tracked', 'conv1', 'conv2', 'bn1', 'bn2', 'fc1', 'fc2',
    'classifier', 'head', '.weight', '.bias',
    # torch.optim param groups
    '["lr",', '["betas",{"$":"tuple","v":[0.9,0.999]}]', '["eps",1e-08]',
    '["weight_decay",0.01]', '["weight_decay",0]', '["amsgrad",false]', '["maximize",false]',
    '["foreach",null]', '["capturable",false]', '["differentiable",false]', '["fused",null]',
    '["decoupled_weight_decay",true]', '["decoupled_weight_decay",false]', '["momentum",0.9]',
    '["dampening",0]', '["nesterov",false]', '["initial_lr",',
    '["param_groups",[{"$":"dict","items":[', '["params",[0,1,2,3,4,5,6,7,8,9,10,',
    # a chain file's meta
    '"lcckpt_chain":{"version":1,"step":', '"kind":"keyframe","state_id":"',
    '"kind":"delta","state_id":"', '"base":null,"depth":0,', '"base":{"step":',
    ',"file":"step-0000000', '.lcc","state_id":"', '"depth":',
    '"settings":{"bits":2,"coder":"auto","error_bound":null,"keyframe_every":50,'
    '"min_delta_elements":8,"target":{"weight":0.007,"first_moment":0.8,'
    '"second_moment":0.1,"relative_to":"movement","update":0.05},'
    '"small_tensors":"exact delta"},"tensors":{',
    '"fallback":', ',"escapes":', '{"kind":"lossless","bits":null,"rel_error":0.0,"target":',
    '{"kind":"exact","bits":null,"rel_error":0.0,',
    # the tree and the sections
    '["model",{"$":"odict","items":[["', ',"shape":[],"stride":[],"packed":true}]',
    '{"version":4,"meta":{"lcckpt_tree":3,"tree":{"$":"dict","items":[["model",'
    '{"$":"dict","items":[["',
    '["optim",{"$":"dict","items":[["state",{"$":"dict","items":[[',
    '{"$":"dict","items":[["step",{"$":"tensor","s":', '["momentum_buffer",{"$":"tensor","s":',
    '["exp_avg",{"$":"tensor","s":', '["exp_avg_sq",{"$":"tensor","s":', '{"$":"tensor","s":',
    '"sections":[{"name":"', '"codec":"raw","device":"cpu"', '"pack[F32@cpu]"',
    '"codec":"lossless","device":"cpu"', '"meta":{"kind":"tensor","dtype":"BF16","shape":[',
    '"meta":{"kind":"tensor","dtype":"F32","shape":[',
    '"codec":"delta","device":"cpu"}},{"name":"obj[\\"optim\\"][\\"state\\"][',
    '"codec":"delta","device":"cpu"}},{"name":"obj[\\"model\\"][\\"',
    '"obj[\\"optim\\"][\\"state\\"][', '][\\"exp_avg\\"]"', '][\\"exp_avg_sq\\"]"',
    '][\\"momentum_buffer\\"]"', ',"target":0.8,"movement":1.0,"step":0.0',
    ',"target":0.1,"movement":1.0,"step":', '{"kind":"uniform","bits":', ',"rel_error":0.00',
    ',"target":0.0', ',"movement":0.', ',"step":0.00', '"obj[\\"model\\"][\\"',
    ',"length":', ',"crc32c":', ',"nbytes":', ',"codec":"delta","device":"cpu"}},{"name":"',
)

HEADER_DICT = "".join(_FRAGMENTS).encode("ascii")
HEADER_DICT_ID = zlib.adler32(HEADER_DICT)      # what a stream that uses it names
