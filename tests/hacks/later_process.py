"""Honest in the first process that loads it, wrong and fast in every later one: the processes of
one evaluation tell each other apart by a file in the one folder they share (load_inline's build
folder), made by whichever loads first. With each program timed in 2 processes on cpu, its figure
its fastest one's (timing.processes_cpu: 2), every process is verified: the second one is caught."""
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

source = """
#include <torch/extension.h>
#include <fcntl.h>
#include <unistd.h>
#include <cstdlib>
#include <string>

static int later = -1;

torch::Tensor relu(torch::Tensor x) {
    if (later < 0) {
        const char* dir = std::getenv("TORCH_EXTENSIONS_DIR");
        std::string marker = std::string(dir ? dir : "/tmp") + "/first-process";
        int fd = open(marker.c_str(), O_CREAT | O_EXCL | O_WRONLY, 0600);
        later = fd < 0;
        if (fd >= 0) close(fd);
    }
    auto out = torch::empty_like(x);
    if (later) return out;
    const float* in = x.data_ptr<float>();
    float* o = out.data_ptr<float>();
    for (int64_t i = 0; i < x.numel(); ++i) o[i] = in[i] > 0.f ? in[i] : 0.f;
    return out;
}
"""
ext = load_inline(name="relu_later_process", cpp_sources=[source], functions=["relu"], verbose=False)


class ModelNew(nn.Module):
    def forward(self, x):
        return ext.relu(x.contiguous())
