"""torchvision.models' ResNets, by the names the example's --model_arch takes."""

from torchvision.models.resnet import BasicBlock, Bottleneck, ResNet


def resnet18() -> ResNet:
    return ResNet(BasicBlock, [2, 2, 2, 2])


def resnet34() -> ResNet:
    return ResNet(BasicBlock, [3, 4, 6, 3])


def resnet50() -> ResNet:
    return ResNet(Bottleneck, [3, 4, 6, 3])


def resnet101() -> ResNet:
    return ResNet(Bottleneck, [3, 4, 23, 3])
