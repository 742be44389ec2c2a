// The encoder kernels as one translation unit (encoder_attention.py builds this file
// alone): each source below includes torch's headers, whose parsing is most of a source's
// compile time, so one unit parses them once where three did. The sources share the
// `compress_encoder` namespace: a name is defined in one of them only.

#include "encoder_attention.cpp"
#include "encoder_norm.cpp"
#include "encoder_activation.cpp"
