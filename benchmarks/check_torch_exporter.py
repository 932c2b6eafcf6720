"""Convert tiny random models of nine encoder/classifier families with one exporter (argv[1]: torch or optimum) and print whether the check against torch passes; with argv[2] `int8`, quantized, and how many layers' attention fused (QAttention)."""
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import transformers as T
from slimml.convert import ConvertConfig, ExportConfig, convert
from slimml.convert.sources import default_model_dir
tok = T.AutoTokenizer.from_pretrained(str(default_model_dir()))
S = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, max_position_embeddings=130)
fams = {
 "distilbert": lambda: T.DistilBertModel(T.DistilBertConfig(vocab_size=30522, dim=32, n_layers=2, n_heads=2, hidden_dim=64)),
 "roberta": lambda: T.RobertaModel(T.RobertaConfig(**S)),
 "xlm-roberta-cls": lambda: T.XLMRobertaForSequenceClassification(T.XLMRobertaConfig(**S, num_labels=3)),
 "mpnet": lambda: T.MPNetModel(T.MPNetConfig(**S)),
 "electra-tok": lambda: T.ElectraForTokenClassification(T.ElectraConfig(**S, embedding_size=32, num_labels=5)),
 "deberta-v2": lambda: T.DebertaV2Model(T.DebertaV2Config(**S)),
 "bert-qa": lambda: T.BertForQuestionAnswering(T.BertConfig(**S)),
 "bert-mlm": lambda: T.BertForMaskedLM(T.BertConfig(**S)),
 "albert": lambda: T.AlbertModel(T.AlbertConfig(**S, embedding_size=16)),
}
exp = sys.argv[1] if len(sys.argv) > 1 else "torch"
int8 = len(sys.argv) > 2 and sys.argv[2] == "int8"
work = Path(tempfile.mkdtemp(prefix="slimml-families-"))
for name, make in fams.items():
    torch.manual_seed(0)
    root = work / name
    make().eval().save_pretrained(root / "src"); tok.save_pretrained(root / "src")
    try:
        quantize = None
        if int8:
            from slimml.quantize import Int8DynamicConfig
            quantize = Int8DynamicConfig(calibration_size=16)
        r = convert(root / "src", root / "art", ConvertConfig(export=ExportConfig(exporter=exp), measure_latency=False, quantize=quantize))
        fused = ""
        if int8:
            import onnx
            ops = [n.op_type for f in (root / "art").glob("shard_*.onnx") for n in onnx.load(str(f), load_external_data=False).graph.node]
            fused = f", int8 QAttention {ops.count('QAttention')} of 2 layers"
        print(T.__version__, exp, name, "OK", r.task, "max abs diff vs torch", r.checks.get("max_abs_diff_vs_torch", r.checks.get("float_max_abs_diff_vs_torch")), fused)
    except Exception as e:
        print(T.__version__, exp, name, "FAIL", type(e).__name__, str(e)[:300])
shutil.rmtree(work, ignore_errors=True)
