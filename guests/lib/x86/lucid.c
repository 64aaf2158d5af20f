#include "libcflat.h"

int lucid_present(void)
{
	static int cached = -1;
	if (cached < 0)
		cached = lucid_hypercall(LUCID_HC_DISCOVER, 0, 0, 0) == LUCID_MAGIC;
	return cached;
}

const char *lucid_backend_name(void)
{
	if (!lucid_present())
		return "unknown";
	switch (lucid_hypercall(LUCID_HC_BACKEND, 0, 0, 0)) {
	case LUCID_BACKEND_VMX: return "vmx";
	case LUCID_BACKEND_SVM: return "svm";
	case LUCID_BACKEND_PVM: return "pvm";
	default: return "unknown";
	}
}
